"""A prompt schedule: the prompt of one streamed video changes at given pixel frames (``--prompt-schedule``).

Text form ``"0:a red circle moving left;64:a blue square moving up"``: entries ``FRAME:PROMPT`` separated by ``;``
(a prompt cannot hold a ``;``; it may hold ``:``, the first one splits). Parsed form ``[(0, "a red ..."), (64, "a blue
...")]``: the form ``eval.moving_shapes_windows.score_windows`` scores. The first entry is at frame 0; frames rise.

A switch takes effect at a chunk's first pixel frame (the chunk is generated under the new prompt), so every frame
after 0 must be one: ``switch_chunks`` checks that against the frames the streaming generator gives
(``StreamingGenerator.chunk_pixel_starts``) and names the valid ones when it is not. Plain Python: importing it loads
no torch (the CLI parses the flag before anything heavy loads).
"""

from typing import Dict, List, Sequence, Tuple

from opensora.cli_errors import UserInputError

FLAG = "--prompt-schedule"


def parse_prompt_schedule(text: str) -> List[Tuple[int, str]]:
    """``"0:A;64:B"`` -> ``[(0, "A"), (64, "B")]``, or a one-line ``UserInputError`` saying what is wrong."""
    entries = [part.strip() for part in str(text).split(";") if part.strip()]
    if not entries:
        raise UserInputError(f'{FLAG} is empty; give FRAME:PROMPT entries separated by ";", e.g. "0:A;64:B"')
    schedule = []
    for entry in entries:
        frame, colon, prompt = entry.partition(":")
        if not colon or not prompt.strip():
            raise UserInputError(f'{FLAG} entry {entry!r} is not FRAME:PROMPT (e.g. "64:a blue square moving up")')
        try:
            frame = int(frame.strip())
        except ValueError:
            raise UserInputError(f"{FLAG} entry {entry!r}: the frame must be a whole number") from None
        if frame < 0:
            raise UserInputError(f"{FLAG} entry {entry!r}: the frame must be >= 0")
        schedule.append((frame, prompt.strip()))
    if schedule[0][0] != 0:
        raise UserInputError(f"{FLAG} must start at frame 0 (the first prompt), got {schedule[0][0]}")
    frames = [frame for frame, _ in schedule]
    if any(b <= a for a, b in zip(frames, frames[1:])):
        raise UserInputError(f"{FLAG} frames must rise from entry to entry, got {', '.join(map(str, frames))}")
    return schedule


def format_schedule(schedule: Sequence[Tuple[int, str]]) -> str:
    """The text form of a parsed schedule (``parse_prompt_schedule`` reads it back)."""
    return ";".join(f"{frame}:{prompt}" for frame, prompt in schedule)


def looks_like_schedule(text: str) -> bool:
    """Whether a prompt text is a schedule's text form (it starts with ``0:``; a caption does not)."""
    return str(text).lstrip().startswith("0:")


def format_frames(frames: Sequence[int], most: int = 8) -> str:
    """``0, 4, 8, ..., 60``: at most ``most`` numbers (the first ones and the last)."""
    frames = list(frames)
    if len(frames) <= most:
        return ", ".join(map(str, frames))
    return ", ".join(map(str, frames[: most - 2])) + f", ..., {frames[-1]}"


def switch_chunks(schedule: Sequence[Tuple[int, str]], chunk_starts: Dict[int, int], num_frames: int):
    """``[(latent start frame, prompt)]`` of every switch after frame 0, for a video of ``num_frames`` pixel frames
    whose chunks start at the pixel frames ``chunk_starts`` maps to their latent start frames; a one-line
    ``UserInputError`` naming the valid frames when a switch is not at a chunk start or is past the video."""
    switches = []
    for frame, prompt in schedule[1:]:
        if frame >= num_frames:
            raise UserInputError(f"{FLAG}: frame {frame} is past the video's {num_frames} frames")
        if frame not in chunk_starts:
            valid = sorted(f for f in chunk_starts if 0 < f < num_frames)
            where = f"at frames {format_frames(valid)}" if valid else "nowhere (the video is one chunk)"
            raise UserInputError(f"{FLAG}: frame {frame} is not where a chunk starts; a prompt can switch {where}")
        switches.append((chunk_starts[frame], prompt))
    return switches
