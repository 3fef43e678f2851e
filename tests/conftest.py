import os
import sys

# Multi-rank tests pickle functions from test modules to spawned ranks; the ranks import them by module name,
# which works because spawn hands the parent's sys.path (with tests/ on it) to the children.
sys.path.insert(0, os.path.dirname(__file__))
