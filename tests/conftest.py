import os
import sys

# Rank bodies live in plain modules beside the tests so spawned ranks can import them; the
# unit tests share helpers the same way.
for _dir in ("multirank", "unit"):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), _dir))
