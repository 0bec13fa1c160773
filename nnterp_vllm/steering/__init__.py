"""Steering experiments: what a request does to the residual stream, where vectors come from, whole grids.

The room's modules import one way, down: `specs` (`Steering`, `Ablate`, `Cap`: checked on the client, carried
per request into the engine) needs nothing but the argument checks, and the engines import it; `sources`
(vectors made elsewhere and contrast vectors from our own harvest, as specs) imports the specs and the
harvest; `sweeps` (a grid as one batch) imports both and the steered engine. Importing this package loads none
of them.
"""
