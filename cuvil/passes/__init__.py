"""Graph passes: pure functions Graph -> Graph. The order they run in lives in cuvil/pipeline.py."""
