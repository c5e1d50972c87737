import os
import sys
from pathlib import Path

# tests import their helpers (tiny_models, ...) by plain module name
sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("WANDB_MODE", "offline")
