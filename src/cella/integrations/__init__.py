"""Agent-framework integrations (behind extras): MCP, LangChain, deepagents, OpenAI Agents."""
