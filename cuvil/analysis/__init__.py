"""Analyses: read-only facts about a Graph (memory plan, shapes)."""
