"""``python -m tierstore.cli``: the ``tierstore`` command without its console script."""

from . import main

raise SystemExit(main())
