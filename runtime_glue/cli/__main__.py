import sys

from runtime_glue.cli.main import main

sys.exit(main())
