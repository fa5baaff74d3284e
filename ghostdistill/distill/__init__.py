"""Fine-tuned recovery: distilling the pruned students against the dense teacher."""
