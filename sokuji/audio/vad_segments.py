"""Speech probabilities (one per 512-sample frame at 16 kHz) to speech segments, exactly as
silero-vad's ``get_speech_timestamps_from_probs`` computes them.

Ported from silero-vad 6.2.3, ``silero_vad/utils_vad.py: get_speech_timestamps_from_probs``
(https://github.com/snakers4/silero-vad), pure Python so that serving needs no torch. The
statements are silero's, in silero's order; the only change is the shape: the loop body is
``SpeechSegmenter.push`` (one probability at a time, so a stream can run it as frames
arrive), the code after the loop is ``SpeechSegmenter.close``, and the padding pass is
``pad_speeches``. ``visualize_probs`` is dropped (it plots). Equality with silero's own
function is tested on random probability sequences and on real audio
(``tests/integration/test_vad_identity.py``).

Original licence (MIT)::

    Copyright (c) 2020-present Silero Team

    Permission is hereby granted, free of charge, to any person obtaining a copy
    of this software and associated documentation files (the "Software"), to deal
    in the Software without restriction, including without limitation the rights
    to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
    copies of the Software, and to permit persons to whom the Software is
    furnished to do so, subject to the following conditions:

    The above copyright notice and this permission notice shall be included in all
    copies or substantial portions of the Software.

    THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
    IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
    FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
    AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
    LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
    OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
    SOFTWARE.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

Speech = dict[str, Any]
"""``{"start": samples, "end": samples}`` (silero's representation)."""


class SpeechSegmenter:
    """silero's state machine over per-frame probabilities. ``speeches`` holds the raw
    (unpadded) segments closed so far; ``current_speech`` the open one (``{}``: none)."""

    def __init__(self, sampling_rate: int = 16000, threshold: float = 0.5,
                 min_speech_duration_ms: float = 250,
                 max_speech_duration_s: float = float("inf"),
                 min_silence_duration_ms: float = 100, speech_pad_ms: float = 30,
                 neg_threshold: float | None = None, min_silence_at_max_speech: float = 98,
                 use_max_poss_sil_at_max_speech: bool = True) -> None:
        self.window_size_samples = window_size_samples = 512 if sampling_rate == 16000 else 256
        self.threshold = threshold
        self.min_speech_samples = sampling_rate * min_speech_duration_ms / 1000
        self.speech_pad_samples = speech_pad_samples = sampling_rate * speech_pad_ms / 1000
        self.max_speech_samples = (sampling_rate * max_speech_duration_s - window_size_samples
                                   - 2 * speech_pad_samples)
        self.min_silence_samples = sampling_rate * min_silence_duration_ms / 1000
        self.min_silence_samples_at_max_speech = sampling_rate * min_silence_at_max_speech / 1000
        self.use_max_poss_sil_at_max_speech = use_max_poss_sil_at_max_speech

        self.triggered = False
        self.speeches: list[Speech] = []
        self.current_speech: Speech = {}
        if neg_threshold is None:
            neg_threshold = max(threshold - 0.15, 0.01)
        self.neg_threshold = neg_threshold
        self.temp_end = 0  # to save potential segment end (and tolerate some silence)
        self.prev_end = self.next_start = 0  # potential limits if the max size is reached
        self.possible_ends: list[tuple[int, int]] = []
        self.frames = 0
        """Probabilities pushed so far (silero's loop index ``i`` of the next one)."""

    def push(self, speech_prob: float) -> None:
        """One iteration of silero's loop (``continue`` is ``return``)."""
        cur_sample = self.window_size_samples * self.frames
        self.frames += 1
        threshold = self.threshold

        # If speech returns after a temp_end, record candidate silence if long enough and
        # clear temp_end
        if (speech_prob >= threshold) and self.temp_end:
            sil_dur = cur_sample - self.temp_end
            if sil_dur > self.min_silence_samples_at_max_speech:
                self.possible_ends.append((self.temp_end, sil_dur))
            self.temp_end = 0
            if self.next_start < self.prev_end:
                self.next_start = cur_sample

        # Start of speech
        if (speech_prob >= threshold) and not self.triggered:
            self.triggered = True
            self.current_speech['start'] = cur_sample
            return

        # Max speech length reached: decide where to cut
        if self.triggered and (cur_sample - self.current_speech['start']
                               > self.max_speech_samples):
            if self.use_max_poss_sil_at_max_speech and self.possible_ends:
                # use the longest possible silence segment in the current speech chunk
                self.prev_end, dur = max(self.possible_ends, key=lambda x: x[1])
                self.current_speech['end'] = self.prev_end
                self.speeches.append(self.current_speech)
                self.current_speech = {}
                self.next_start = self.prev_end + dur

                # previously reached silence (< neg_thres) and is still not speech (< thres)
                if self.next_start < self.prev_end + cur_sample:
                    self.current_speech['start'] = self.next_start
                else:
                    self.triggered = False
                self.prev_end = self.next_start = self.temp_end = 0
                self.possible_ends = []
            else:
                # Legacy max-speech cut (use_max_poss_sil_at_max_speech=False): prefer last
                # valid silence (prev_end) if available
                if self.prev_end:
                    self.current_speech['end'] = self.prev_end
                    self.speeches.append(self.current_speech)
                    self.current_speech = {}
                    if self.next_start < self.prev_end:
                        self.triggered = False
                    else:
                        self.current_speech['start'] = self.next_start
                    self.prev_end = self.next_start = self.temp_end = 0
                    self.possible_ends = []
                else:
                    # No prev_end -> fallback to cutting at current sample
                    self.current_speech['end'] = cur_sample
                    self.speeches.append(self.current_speech)
                    self.current_speech = {}
                    self.prev_end = self.next_start = self.temp_end = 0
                    self.triggered = False
                    self.possible_ends = []
                    return

        # Silence detection while in speech
        if (speech_prob < self.neg_threshold) and self.triggered:
            if not self.temp_end:
                self.temp_end = cur_sample
            sil_dur_now = cur_sample - self.temp_end

            # condition to avoid cutting in very short silence
            if (not self.use_max_poss_sil_at_max_speech
                    and sil_dur_now > self.min_silence_samples_at_max_speech):
                self.prev_end = self.temp_end

            if sil_dur_now < self.min_silence_samples:
                return
            else:
                self.current_speech['end'] = self.temp_end
                if ((self.current_speech['end'] - self.current_speech['start'])
                        > self.min_speech_samples):
                    self.speeches.append(self.current_speech)
                self.current_speech = {}
                self.prev_end = self.next_start = self.temp_end = 0
                self.triggered = False
                self.possible_ends = []
                return

    def close(self, audio_length_samples: int) -> list[Speech]:
        """silero's code after the loop: the open segment ends with the audio. Returns the
        raw segments (``pad_speeches`` pads them)."""
        current_speech = self.current_speech
        if current_speech and (audio_length_samples - current_speech['start']
                               ) > self.min_speech_samples:
            current_speech['end'] = audio_length_samples
            self.speeches.append(current_speech)
        self.current_speech = {}
        return self.speeches


def pad_speeches(speeches: list[Speech], speech_pad_samples: float,
                 audio_length_samples: int) -> list[Speech]:
    """silero's padding pass, in place: the first start and the last end get the pad; a gap
    between neighbours shorter than two pads is split in half, else each side gets a pad."""
    for i, speech in enumerate(speeches):
        if i == 0:
            speech['start'] = int(max(0, speech['start'] - speech_pad_samples))
        if i != len(speeches) - 1:
            silence_duration = speeches[i+1]['start'] - speech['end']
            if silence_duration < 2 * speech_pad_samples:
                speech['end'] += int(silence_duration // 2)
                speeches[i+1]['start'] = int(max(0, speeches[i+1]['start']
                                                 - silence_duration // 2))
            else:
                speech['end'] = int(min(audio_length_samples, speech['end']
                                        + speech_pad_samples))
                speeches[i+1]['start'] = int(max(0, speeches[i+1]['start']
                                                 - speech_pad_samples))
        else:
            speech['end'] = int(min(audio_length_samples, speech['end'] + speech_pad_samples))
    return speeches


def get_speech_timestamps_from_probs(
        speech_probs: Iterable[float], sampling_rate: int = 16000, threshold: float = 0.5,
        min_speech_duration_ms: float = 250, max_speech_duration_s: float = float('inf'),
        min_silence_duration_ms: float = 100, speech_pad_ms: float = 30,
        return_seconds: bool = False, time_resolution: int = 1,
        neg_threshold: float | None = None, min_silence_at_max_speech: float = 98,
        use_max_poss_sil_at_max_speech: bool = True, audio_length_samples: int | None = None,
        step: int = 1) -> list[Speech]:
    """silero's function, same arguments (less ``visualize_probs``), same result."""
    segmenter = SpeechSegmenter(
        sampling_rate, threshold, min_speech_duration_ms, max_speech_duration_s,
        min_silence_duration_ms, speech_pad_ms, neg_threshold, min_silence_at_max_speech,
        use_max_poss_sil_at_max_speech)
    for speech_prob in speech_probs:
        segmenter.push(speech_prob)
    if audio_length_samples is None:
        audio_length_samples = segmenter.frames * segmenter.window_size_samples
    speeches = pad_speeches(segmenter.close(audio_length_samples),
                            segmenter.speech_pad_samples, audio_length_samples)

    if return_seconds:
        audio_length_seconds = audio_length_samples / sampling_rate
        for speech_dict in speeches:
            speech_dict['start'] = max(round(speech_dict['start'] / sampling_rate,
                                             time_resolution), 0)
            speech_dict['end'] = min(round(speech_dict['end'] / sampling_rate,
                                           time_resolution), audio_length_seconds)
    elif step > 1:
        for speech_dict in speeches:
            speech_dict['start'] *= step
            speech_dict['end'] *= step
    return speeches
