/**
 * What the client says on the wire (CONTRACT.md: POST /v1/realtime/calls, hang-up, session.update)
 * and how it words failures for a person. Pure functions: no DOM, no network; Node tests them.
 */

export const CALLS_PATH = '/v1/realtime/calls';
// The server's STUN/TURN servers (its --ice-server), for callers beyond its LAN.
export const ICE_SERVERS_PATH = '/v1/realtime/ice_servers';
// The server's model, with what it takes in (duplex lists `input_modalities`; OpenAI does not).
export const MODELS_PATH = '/v1/models';

// What a camera or a shared screen sends: the model reads a few small pictures a second, so the
// browser need not encode more (the server samples and scales what comes anyway).
export const CAMERA_CONSTRAINTS = Object.freeze({
  width: { ideal: 640 }, height: { ideal: 480 }, frameRate: { ideal: 5, max: 15 },
});
export const SCREEN_CONSTRAINTS = Object.freeze({ frameRate: { ideal: 5, max: 15 } });

export const MESSAGES = Object.freeze({
  insecureContext: 'This page cannot use a microphone here: open it over https, or on localhost.',
  iceFailed: 'The media connection failed (ICE): the browser and the server found no network path '
    + 'to each other. A server on another machine needs a reachable --ice-host or an --ice-server.',
  connectTimeout: 'The media connection did not come up in time (ICE). Check the network between '
    + 'this browser and the server.',
  badAnswer: 'The server answered with an SDP this browser cannot use.',
  noAnswer: 'The server accepted the connection but did not answer the call in time.',
});

/** The Authorization header for an API key typed by the user; none when the field is empty. */
export function authHeaders(apiKey) {
  const key = (apiKey ?? '').trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

/** The call id in a `Location: /v1/realtime/calls/{call_id}` header, or null when there is none. */
export function callIdFromLocation(location) {
  if (!location) return null;
  const path = new URL(location, 'http://origin.invalid').pathname;
  const prefix = `${CALLS_PATH}/`;
  if (!path.startsWith(prefix)) return null;
  const id = decodeURIComponent(path.slice(prefix.length));
  return id && !id.includes('/') ? id : null;
}

export function hangupPath(callId) {
  return `${CALLS_PATH}/${encodeURIComponent(callId)}/hangup`;
}

/**
 * Whether the server's model sees (a `GET /v1/models` answer that lists "image" among a model's
 * `input_modalities`): then a call offers video, and the page a camera and a screen share.
 * Anything else (another server, an error body) reads as a model that does not.
 */
export function modelSees(body) {
  const models = Array.isArray(body?.data) ? body.data : [];
  return models.some((model) => Array.isArray(model?.input_modalities)
    && model.input_modalities.includes('image'));
}

/** Constraints for getUserMedia: the chosen device (exact), and the browser's voice processing. */
export function audioConstraints({ deviceId, echoCancellation, noiseSuppression, autoGainControl }) {
  return {
    ...(deviceId ? { deviceId: { exact: deviceId } } : {}),
    echoCancellation, noiseSuppression, autoGainControl,
  };
}

/**
 * The `session.update` for the settings form. Empty instructions or voice leave the server's own,
 * and so does an empty turn detection: the server's choice, from its `session.created` (semantic
 * where its model reads the user's words, so a pause inside a sentence is not answered). Chosen,
 * it is server_vad (a silence ends the turn) or semantic_vad (the server judges when the user has
 * finished), always with answers and barge-in on, since this is a voice chat.
 */
export function sessionUpdate({
  instructions, voice, turnDetection = '', eagerness = 'auto', vadThreshold, silenceDurationMs,
}) {
  const session = { type: 'realtime' };
  const turns = chosenTurnDetection({ turnDetection, eagerness, vadThreshold, silenceDurationMs });
  if (turns) session.audio = { input: { turn_detection: turns } };
  if (instructions.trim()) session.instructions = instructions.trim();
  if (voice.trim()) session.audio = { ...session.audio, output: { voice: voice.trim() } };
  return { type: 'session.update', session };
}

/** The turn detection the user chose in the form, or null to keep the server's. */
function chosenTurnDetection({ turnDetection, eagerness, vadThreshold, silenceDurationMs }) {
  const on = { create_response: true, interrupt_response: true };
  if (turnDetection === 'semantic_vad') return { type: 'semantic_vad', eagerness, ...on };
  if (turnDetection === 'server_vad') {
    return { type: 'server_vad', threshold: vadThreshold, silence_duration_ms: silenceDurationMs, ...on };
  }
  return null;
}

/** The message of an OpenAI-style error body, or a short plain-text body; null otherwise. */
function errorBodyMessage(body) {
  try {
    const message = JSON.parse(body)?.error?.message;
    if (typeof message === 'string' && message) return message;
  } catch {
    // Not JSON: a proxy's or a server's plain text; shown when it is short and not a page.
    const text = (body ?? '').trim();
    if (text && text.length <= 200 && !text.startsWith('<')) return text;
  }
  return null;
}

/** What to tell the user when POST /v1/realtime/calls did not answer 201. */
export function describeHttpError(status, body, retryAfter) {
  const detail = errorBodyMessage(body);
  const because = detail ? `: ${detail}` : '';
  if (status === 401 || status === 403) {
    return `The server refused the API key (HTTP ${status})${because}. Enter the key in Settings.`;
  }
  if (status === 503) {
    const when = retryAfter ? `in ${retryAfter} s` : 'later';
    return `The server has no free session (HTTP 503)${because}. Try again ${when}.`;
  }
  if (status >= 500) return `The server failed to start the call (HTTP ${status})${because}.`;
  return `The server refused the call (HTTP ${status})${because}.`;
}

/** What to tell the user when the fetch itself failed (no HTTP answer at all). */
export function describeUnreachable(url) {
  return `Cannot reach the server at ${url}: is it running, and is this the right address?`;
}

/** What to tell the user when getUserMedia failed, by the DOMException's name. */
export function describeMediaError(error) {
  switch (error?.name) {
    case 'NotAllowedError':
    case 'SecurityError':
      return 'Microphone permission was denied. Allow the microphone for this site (the icon in '
        + 'the address bar) and connect again.';
    case 'NotFoundError':
      return 'No microphone was found. Plug one in and connect again.';
    case 'NotReadableError':
      return 'The microphone could not be opened: another application may be using it.';
    case 'OverconstrainedError':
      return 'The chosen microphone is not available any more. Choose another one.';
    default:
      return `The microphone could not be opened (${error?.message || error?.name || error}).`;
  }
}
