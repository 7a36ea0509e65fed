"""``python -m hopperjax.train``: runs the training CLI, ``hopperjax.cli.main`` (options and exit
codes: ``hopperjax.cli.DESCRIPTION``). Nothing imports this module: doing so would rebind the
package's name ``hopperjax.train`` (the library's function) to it.
"""

import sys

from hopperjax.cli import main

if __name__ == "__main__":
    sys.exit(main())
