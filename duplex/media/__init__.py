"""Audio at the session's edges: sample formats and G.711 (``pcm``), resampling (``resample``),
where the agent's audio goes (``playout``) and the paced WebRTC track (``paced_track``)."""
