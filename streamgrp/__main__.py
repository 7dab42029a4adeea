import sys

from streamgrp.cli import main

sys.exit(main())
