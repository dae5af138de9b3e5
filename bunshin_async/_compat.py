"""What the supported Pythons (3.10 to 3.13) spell differently; everything else is written for 3.10."""

from __future__ import annotations

import enum
import sys

if sys.version_info >= (3, 11):
    from builtins import BaseExceptionGroup as BaseExceptionGroup
    from enum import StrEnum as StrEnum
else:  # pragma: no cover - 3.10
    from exceptiongroup import BaseExceptionGroup as BaseExceptionGroup

    class StrEnum(str, enum.Enum):
        """enum.StrEnum of 3.11: members are their values as str, in f-strings and str() alike."""

        def __str__(self) -> str:
            return str(self.value)
