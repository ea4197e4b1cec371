#!/usr/bin/env bash
# Regenerates the speech clips under tests/data and clips.json (needs espeak-ng and sox with
# flac/ogg/mp3 support: `apt-get install -y espeak-ng sox libsox-fmt-all`).
# Each clip: espeak-ng speech (22.05 kHz mono), padded with silence, converted by sox to the
# rate, channel count and format its name says (no dither, so reruns give the same samples;
# the ogg file differs only in its random stream serial number).
# Stereo clips carry a quieter copy on the right.
set -euo pipefail
cd "$(dirname "$0")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# file|rate|channels|transcript
clips=(
  "en_24k_mono.wav|24000|1|The quick brown fox jumps over the lazy dog."
  "en_16k_mono.wav|16000|1|She sells sea shells by the sea shore, every summer."
  "en_8k_mono.wav|8000|1|Please call Stella and ask her to bring these things with her."
  "en_44k_stereo.flac|44100|2|A rainbow is a division of white light into many beautiful colors."
  "en_48k_stereo.ogg|48000|2|Birds of a feather flock together, or so they say."
  "en_22k_mono.mp3|22050|1|We will meet again at the old station tomorrow morning."
)

json="{"
sep=""
for entry in "${clips[@]}"; do
  IFS='|' read -r file rate channels text <<<"$entry"
  espeak-ng -v en-us -s 155 -w "$tmp/speech.wav" "$text"
  remix=()
  if [ "$channels" = 2 ]; then remix=(remix 1 1v0.6); fi
  sox -D "$tmp/speech.wav" -r "$rate" -b 16 "$tmp/out.${file##*.}" pad 0.4 0.6 "${remix[@]}" 2>/dev/null \
    || sox -D "$tmp/speech.wav" -r "$rate" "$tmp/out.${file##*.}" pad 0.4 0.6 "${remix[@]}"
  mv "$tmp/out.${file##*.}" "$file"
  json+="$sep\n  \"$file\": {\"transcript\": \"$text\", \"rate\": $rate, \"channels\": $channels}"
  sep=","
done
printf '%b\n}\n' "$json" > clips.json
ls -l "${clips[@]%%|*}" clips.json
