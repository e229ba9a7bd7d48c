import sys

from stream_reward.ops import early_signals

early_signals.keep()  # a Ctrl-C in the imports below: one line (see stream_reward.worker.main.main)

from stream_reward.worker.main import main  # noqa: E402

sys.exit(main())
