"""The planner's two kinds of error: bad input (`PlanError`, the CLI's exit code 2) and a missing optional package
(`MissingPackage`, exit code 1), each with a message that says what to do."""

from __future__ import annotations

from typing import Optional


class PlanError(ValueError):
    """Bad input: an unknown model, a size or count out of range, an unreadable file, an unknown class.

    Args:
        message (`str`): What is wrong and how to fix it.
        argument (`str`, *optional*): The argument at fault, as the command line spells it (`"--steps"`).
    """

    def __init__(self, message: str, argument: Optional[str] = None) -> None:
        super().__init__(message)
        self.argument = argument


class MissingPackage(RuntimeError):
    """Something asked for needs a package that is not installed.

    Args:
        package (`str`): The missing package (`"transformers"`).
        needed_by (`str`): What needs it and why ("the demo (its tiny pipelines use CLIP and T5 text encoders)").
        command (`str`, *optional*): The command that installs it; `pip install <package>` by default.
    """

    def __init__(self, package: str, needed_by: str, command: Optional[str] = None) -> None:
        self.package = package
        self.command = command or f"pip install {package}"
        super().__init__(f"{package} is not installed; {needed_by} needs it. Install it with: {self.command}")
