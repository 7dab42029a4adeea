import sys

from streamgrp.cli.main import main

sys.exit(main())
