import sys

from axonml_distributed.demo import main

sys.exit(main())
