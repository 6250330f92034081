"""The one exception a bad configuration raises; the CLI turns it into exit status 2."""


class ConfigError(Exception):
    """One or more configuration problems, each a full sentence naming the key or file."""

    def __init__(self, problems):
        if isinstance(problems, str):
            problems = [problems]
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))

    def __str__(self):
        if len(self.problems) == 1:
            return self.problems[0]
        return f"{len(self.problems)} configuration problems:\n" + "\n".join(
            f"  - {p}" for p in self.problems)
