"""Exit codes, the same for every subcommand (README, REQUIREMENTS.md section 8)."""

from typing import Final

EXIT_OK: Final = 0
EXIT_PROBLEM: Final = 1  # it ran and found a problem: differs, unhealthy, --strict, no room
EXIT_USAGE: Final = 2  # it could not run or judge: bad option, unusable config, no answer
EXIT_NO_SEGMENT: Final = 3  # there is no segment to read
EXIT_WARNING: Final = 4  # availability --check: a state that may be meant, but admits nothing
