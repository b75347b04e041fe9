"""Cluster: Ray placement, actors, the pipeline, recovery, shipping, stage CPUs and metrics.

The only package that imports Ray, besides orchestrator.serving.
"""
