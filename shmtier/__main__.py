import sys

from shmtier.cli import main

sys.exit(main())
