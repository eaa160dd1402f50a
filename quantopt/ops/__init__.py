"""Built-in operators. Each module declares the operators of one family (`declare_op`: typed params, docs, and the
float/integer forward and quantize attached to the declaration); modules never import each other, shared helpers
live in `_shared` and `_quant`, and `api` is the public helper API for plugin operators (docs/plugins.md)."""
from . import (  # noqa: F401
    activation,
    api,
    batchnorm_pad,
    binary_math,
    concat,
    conv,
    convert,
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
