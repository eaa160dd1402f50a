"""Built-in operators. Each module registers float/integer forward (and later quantize) functions for one
family; modules never import each other, shared float helpers live in `_shared`."""
from . import (  # noqa: F401
    activation,
    batchnorm_pad,
    concat,
    conv,
    eltwise,
    io,
    linear,
    pooling,
    shape,
    softmax,
)
