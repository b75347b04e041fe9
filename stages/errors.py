"""The base of every error the ``orchestrate`` command reports in one line.

It sits at the bottom of the import map (stages is imported by every other
package) so that each package's own errors derive from it. The command turns
a ``SpecpipeError`` into one ``error:`` line and exit status 1; anything else
is a bug and shows its traceback.
"""


class SpecpipeError(Exception):
    """An error a user can cause (bad files, bad settings, a cluster that cannot
    run the stages); its message is one line that says what and where."""


class GrammarError(SpecpipeError):
    """A grammar that cannot be used (a bad ``response_format``, a token the
    grammar forbids where one was required); one line naming what is at fault."""
