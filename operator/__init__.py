"""nodepulse operator (import name `nodeoperator`; see pyproject.toml)."""

__version__ = "0.1.0"
