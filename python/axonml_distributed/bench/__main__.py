import sys

from axonml_distributed.bench import main

sys.exit(main())
