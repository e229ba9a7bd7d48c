import sys

from stream_reward.ops import early_signals

early_signals.keep()  # a Ctrl-C in the imports below: one line (see workers.main.main)

from workers.main import main  # noqa: E402

sys.exit(main())
