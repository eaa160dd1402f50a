"""Built-in operators. Each module registers float/integer forward (and later quantize) functions for one
family; modules never import each other, shared float helpers live in `_shared`."""
from . import (  # noqa: F401
    activation,
    batchnorm_pad,
    binary_math,
    concat,
    conv,
    detection,
    eltwise,
    geometry,
    indexing,
    io,
    linear,
    mac_extra,
    normalization,
    pooling,
    recurrent,
    reduce,
    roi,
    shape,
    softmax,
    unary_math,
)
