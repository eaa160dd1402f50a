"""Building blocks of the ONNX QDQ mappings that the operators declare (`@SPEC.export`, docs/onnx-export.md).

Every built-in operator's mapping is declared beside its `declare_op`, in its own ops module; what several mappings
share is here: the graph under construction (`qdq_graph`), layouts (`perms`), the exact integer emitters (`exact`),
the weight/requantization helpers of the MAC layers (`mac`), the float forms (`float_forms`, `activation_forms`) and
the recurrent cell builders (`recurrent`). It sits inside the operators' unit, below nothing it needs: the exporter
(quantopt/exporters) only drives it. Nothing here imports `onnx` at module level (the dependency is optional);
`QDQGraph` imports it when a graph is made.
"""
