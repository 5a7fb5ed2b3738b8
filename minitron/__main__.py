from .tools.cli import entry

entry()
