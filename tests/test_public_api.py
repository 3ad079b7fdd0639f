"""The public namespace is exactly what the docs promise."""

import resumable
import resumable.exceptions
import resumable.testing


def test_all_is_sorted_and_complete():
    """__all__ lists every public name once, sorted, and each exists."""
    assert sorted(resumable.__all__) == resumable.__all__
    assert len(set(resumable.__all__)) == len(resumable.__all__)
    for name in resumable.__all__:
        assert hasattr(resumable, name), name


def test_no_other_public_names():
    """Everything not in __all__ is private (underscored) or a submodule."""
    public = {n for n in dir(resumable) if not n.startswith("_")}
    submodules = {"exceptions", "testing"}
    assert set(resumable.__all__) == public - submodules


def test_exception_tree():
    """Every error is a ResumableError and also the fitting built-in."""
    e = resumable.exceptions
    assert issubclass(e.StepDefinitionError, TypeError)
    assert issubclass(e.FingerprintError, TypeError)
    assert issubclass(e.SerializationError, TypeError)
    assert issubclass(e.StateFormatError, ValueError)
    assert issubclass(e.StateLockedError, RuntimeError)
    assert issubclass(e.InputChangedError, ValueError)
    assert issubclass(e.StepInterruptedError, RuntimeError)
    assert issubclass(e.UsageError, ValueError)
    assert issubclass(e.StateDirectoryError, OSError)
    for name in e.__all__:
        cls = getattr(e, name)
        if name != "ResumableWarning":
            assert issubclass(cls, resumable.ResumableError), name
    assert issubclass(e.ResumableWarning, UserWarning)


def test_testing_module_names():
    """resumable.testing exports its helpers."""
    assert sorted(resumable.testing.__all__) == resumable.testing.__all__
    for name in resumable.testing.__all__:
        assert hasattr(resumable.testing, name)
