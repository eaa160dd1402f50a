"""A QConfig plugin (docs/plugins.md, "QConfig plugins"): 16-bit activations for the first convolution and the last
FullyConnected layer of any model, a rule the cfg's per-layer syntax cannot say without knowing the layer ids.

Use: put this file in ./plugin (or a folder on AIPUPLUGIN_PATH) and write `qconfig = WideEnds` in the cfg."""
from typing import Any, Dict

from quantopt import OptBaseQConfig, PluginType, register_plugin


@register_plugin(PluginType.QConfig, "1.0")
class WideEnds(OptBaseQConfig):
    def configure(self, graph: Any) -> Dict[str, Dict[str, Any]]:
        convs = [n for n in graph.nodes if str(n.type) == "Convolution"]
        fcs = [n for n in graph.nodes if str(n.type) == "FullyConnected"]
        wanted: Dict[str, Dict[str, Any]] = {}
        if convs:
            wanted[convs[0].name] = {"q_bits_activation": 16}
        if fcs:
            wanted[fcs[-1].name] = {"q_bits_activation": 16, "q_bits_bias": 48}
        return wanted
