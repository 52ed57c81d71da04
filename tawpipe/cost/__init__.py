"""The accounting layer: what a plan costs before it runs.

``traffic`` (bytes per sender, receiver, kind and node link; link time and the network floor;
closed forms for the peers) and ``memory`` (memory per rank, and the choice of k within a
budget). Imports only ``tawpipe.plan``.
"""
