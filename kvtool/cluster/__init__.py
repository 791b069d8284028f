"""Clusters of nodes (network namespaces on one box, or real hosts) run with Ray.

:mod:`kvtool.cluster.state` is what ``kvtool cluster up`` recorded; the other modules
bring a cluster up and down and drive it.
"""
