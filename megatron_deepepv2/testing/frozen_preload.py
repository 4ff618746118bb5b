"""Imported last by a forkserver that preloads what its processes import (the demo's CPU ranks, the tests' ranks).

Everything the server imported lives as long as the server and every process forked from it, so it is moved out of
the garbage collector's reach (``gc.freeze()``): a forked process's full collections skip it (and leave its memory
pages shared with the server), and the server's exit skips the final collection over Megatron's and torch's objects,
seconds of CPU otherwise.
"""

import gc

gc.freeze()
