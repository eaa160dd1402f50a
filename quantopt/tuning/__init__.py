"""Calibration steps that quantize provisionally to decide: scale unification across multi-input layers, the global
calibration methods and the mixed-precision search. They sit above the quantizer (they call it), while the
statistics and local calibration below the operators (`quantopt.calibration`) never quantize.
"""
