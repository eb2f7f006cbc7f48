"""``--cond-type`` and ``--ref`` checked together before any model is built: a reference condition needs a reference
that decodes, and a reference is only used by a reference condition."""

from pathlib import Path

from opensora.cli_errors import UserInputError


def check_reference(cond_type: str, ref) -> None:
    """One ``UserInputError`` line for a missing, unreadable or unused ``--ref``."""
    if cond_type == "t2v":
        if ref is not None:
            raise UserInputError(
                f"--ref {ref} is only used by a reference condition: add --cond-type i2v_head (an image) or "
                "v2v_head (a video), or drop --ref"
            )
        return
    kind = "an image" if cond_type.startswith("i2v") else "a video"
    if ref is None:
        raise UserInputError(f"--cond-type {cond_type} needs a reference: pass --ref PATH ({kind})")
    from opensora.datasets.video_io import read_video

    try:
        read_video(Path(str(ref)), max_frames=1)  # decodes its first frame only
    except Exception as error:  # PIL, PyAV and OS errors alike: the file is not a picture this can use
        first = str(error).splitlines()[0][:160] if str(error) else type(error).__name__
        raise UserInputError(f"--ref {ref} cannot be read as an image or video ({first}); give {kind} file") from None
