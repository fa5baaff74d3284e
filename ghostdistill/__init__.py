"""ghostdistill: make layer-pruned causal LMs good again.

Remove whole decoder blocks, then repair each gap with a closed-form linear "ghost" operator
(training-free), optionally followed by distillation against the dense teacher.
"""

__version__ = "0.1.0"
