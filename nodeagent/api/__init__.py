"""What the agent and the operator share, and nothing else of the project.

This package must not import any other part of nodepulse.
"""
