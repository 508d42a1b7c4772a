"""The client side that tests and evaluation/ share: a real server process (``server``), aiortc
client peers (``peers``) with a scripted microphone (``mic``), WebRTC calls against a server
(``calls``), speech made at run time (``speech``) and word error rates (``wer``)."""
