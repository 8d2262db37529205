import sys
from pathlib import Path

# The tests share the `reference` helpers next to this file.
sys.path.insert(0, str(Path(__file__).parent))
