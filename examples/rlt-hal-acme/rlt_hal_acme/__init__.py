"""Example third-party rlt-hal driver ("acme")."""
