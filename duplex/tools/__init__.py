"""Tools the server runs itself: remote MCP servers (OpenAI's ``{"type": "mcp"}`` tools), and a
transport's own function (``transfer_call``).

- ``mcp_spec``: the ``mcp`` tool object of ``session.update`` / ``response.create``, checked (pure);
- ``mcp_client``: one connection to one MCP server (streamable HTTP, the ``mcp`` SDK), with its limits;
- ``mcp_items``: the MCP items of the conversation (list, call, approval request and response);
- ``mcp_session``: a session's MCP servers, their tools as the model is offered them, and calls;
- ``transfer_call``: the built-in tool that hands a SIP call on to a target the preset names.

Other function tools are the client's: the server passes their calls through (``duplex/session``).
"""
