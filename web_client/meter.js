/**
 * Audio levels: the input meter, the agent meter and the page's data-local-level /
 * data-remote-level hooks. `rms` and `meterValue` are pure; `levelProbe` needs Web Audio.
 */

/** Root mean square of float samples in [-1, 1]. */
export function rms(samples) {
  if (samples.length === 0) return 0;
  let sum = 0;
  for (const sample of samples) sum += sample * sample;
  return Math.sqrt(sum / samples.length);
}

// The meters show -60..0 dBFS: speech sits in the upper half instead of a sliver at the bottom.
const METER_FLOOR_DB = -60;

/** An RMS level as a meter position in [0, 1] on a dB scale. */
export function meterValue(level) {
  if (level <= 0) return 0;
  const db = 20 * Math.log10(level);
  return Math.min(1, Math.max(0, 1 - db / METER_FLOOR_DB));
}

/**
 * Measures `stream` on `context` through an AnalyserNode. The probe owns its two nodes from here to
 * `disconnect()` (hang-up, or another microphone). It does not feed the speakers: the remote audio
 * plays through the page's <audio> element, and the microphone must never be played back.
 */
export function levelProbe(context, stream) {
  const source = context.createMediaStreamSource(stream);
  const analyser = context.createAnalyser();
  analyser.fftSize = 1024;
  source.connect(analyser);
  const samples = new Float32Array(analyser.fftSize);
  return {
    level() {
      analyser.getFloatTimeDomainData(samples);
      return rms(samples);
    },
    disconnect() {
      source.disconnect();
    },
  };
}
