"""``python -m gateway.cli``: ``inferctl`` without the installed script."""

import sys

from inferflux.gateway.cli import main

sys.exit(main())
