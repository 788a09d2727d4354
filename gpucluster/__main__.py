import sys

from gpucluster.cli import main

sys.exit(main())
