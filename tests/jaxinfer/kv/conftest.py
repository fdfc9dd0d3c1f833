"""The kv tests share kv_support.py (a sequence as the KV cache manager sees it)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
