"""Regenerates the fixtures here from the research WAVs (/work/tools/issue14/wav: espeak-ng
speech, converted with sox; see README.md). Run: python tests/data/media/audio/make.py SRC_DIR.
Cuts are sample-exact slices of the PCM (no re-quantising); the float and 24-bit files are
made from talk16k.wav with numpy + soundfile, deterministically."""

import sys
from pathlib import Path

import numpy as np
import soundfile as sf

src, here = Path(sys.argv[1]), Path(__file__).parent


def cut(name: str, out: str, start_s: float, end_s: float) -> None:
    x, rate = sf.read(src / name, dtype="int16")
    sf.write(here / out, x[int(start_s * rate):int(end_s * rate)], rate, subtype="PCM_16")


for name in ("talk16k.wav", "talk16k.flac", "talk8k.wav"):
    (here / name).write_bytes((src / name).read_bytes())
cut("talk22k.wav", "talk22k_cut.wav", 4.2, 9.6)
cut("talk48k.wav", "talk48k_cut.wav", 0.0, 4.2)
cut("talk44k_stereo.wav", "talk44k_stereo_cut.wav", 4.2, 7.8)
(here / "silence.wav").write_bytes((src / "sil1.wav").read_bytes())

x, rate = sf.read(src / "talk16k.wav", dtype="float32")
noise = np.random.default_rng(14).normal(0, 1e-4, len(x)).astype(np.float32)
y = 0.9 * x + noise
sf.write(here / "talk16k_float.wav", y[:int(3.6 * rate)], rate, subtype="FLOAT")
sf.write(here / "talk16k_24bit.wav", y[int(4.2 * rate):int(8.0 * rate)], rate,
         subtype="PCM_24")
