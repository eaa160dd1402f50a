"""Graph core: OpType registry, PyTensor, PyNode, PyGraph and QuantizeGraph."""
