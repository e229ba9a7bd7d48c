import sys

from workers.main import main

sys.exit(main())
