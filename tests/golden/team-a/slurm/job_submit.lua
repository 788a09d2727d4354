-- Rendered by gpucluster for stack team-a. Change the stack file and run `pulumi up`; edits here are lost.

local DEFAULT_PARTITION = "p5-od"
local PARTITIONS = {
  ["p5-od"] = {
    {name = "p5-od", nodes = 4, cpus = 192, memory_mib = 1992294, gres = {gpu = {count = 8, type = "h100"}}},
  },
  ["p5-spot"] = {
    {name = "p5-spot", nodes = 8, cpus = 192, memory_mib = 1992294, gres = {gpu = {count = 8, type = "h100"}}},
  },
}

-- The check: fixed, the data above is the stack's.

-- A number the job gave, or nil for Slurm's "not given" sentinels.
local function given(value)
  if value == nil or value == slurm.NO_VAL or value == slurm.NO_VAL16 or value == slurm.NO_VAL64 then
    return nil
  end
  return value
end

-- Generic resources asked for: "gres/gpu:8", "gres/gpu:h100:8", "gres/gpu=2",
-- comma-separated; entries that are not generic resources ("cpu=4") are skipped. Returns name -> {count, type},
-- or nil when a count cannot be read (the job is then left to Slurm).
local function gres_asked(tres)
  local asked = {}
  if tres == nil then
    return asked
  end
  for entry in string.gmatch(tres, "[^,]+") do
    local spec = string.match(entry, "^gres/(.+)$")
    if spec then
      local fields = {}
      for field in string.gmatch(spec, "[^:=]+") do
        table.insert(fields, field)
      end
      local kind, count = nil, 1
      if #fields == 2 and string.match(fields[2], "^%d") then
        count = tonumber(fields[2])  -- nil for "1k": Slurm's suffixes are not read here
      elseif #fields == 2 then
        kind = fields[2]
      elseif #fields > 2 then
        kind, count = fields[2], tonumber(fields[3])
      end
      if count == nil then
        return nil
      end
      asked[fields[1]] = {count = count, type = kind}
    end
  end
  return asked
end

local NAMES = {gpu = "GPU", neuron = "Neuron device"}

local function counted(count, name)
  return string.format("%d %s%s", count, name, count == 1 and "" or "s")
end

local function gres_text(name, gres)
  local text = counted(gres.count, NAMES[name] or name)
  return gres.type and string.format("%s (%s)", text, gres.type) or text
end

local function gib(mib)
  return string.format(mib % 1024 == 0 and "%d GiB" or "%.1f GiB", mib / 1024)
end

local function node_text(pool)
  local parts = {}
  for name, gres in pairs(pool.gres) do
    table.insert(parts, gres_text(name, gres))
  end
  if #parts == 0 then
    table.insert(parts, "no accelerator")
  end
  table.insert(parts, counted(pool.cpus, "CPU"))
  table.insert(parts, gib(pool.memory_mib))
  return table.concat(parts, ", ")
end

local function shapes_text(pools)
  if #pools == 1 then
    return string.format("a node has %s, up to %s", node_text(pools[1]), counted(pools[1].nodes, "node"))
  end
  local texts = {}
  for _, pool in ipairs(pools) do
    table.insert(texts, string.format("%s (pool %s, up to %s)", node_text(pool), pool.name,
                                      counted(pool.nodes, "node")))
  end
  return "a node has " .. table.concat(texts, " or ")
end

-- What the job needs of each of its nodes and in all, or nil when its request cannot be read.
local function needs(job_desc)
  local tasks = given(job_desc.ntasks_per_node) or 1
  local cpus = math.max((given(job_desc.cpus_per_task) or 1) * tasks, given(job_desc.pn_min_cpus) or 0)
  local memory = given(job_desc.min_mem_per_node)
  if given(job_desc.min_mem_per_cpu) then
    memory = job_desc.min_mem_per_cpu * cpus
  end
  local per_node, per_task = gres_asked(job_desc.tres_per_node), gres_asked(job_desc.tres_per_task)
  local in_all = gres_asked(job_desc.tres_per_job)
  if per_node == nil or per_task == nil or in_all == nil then
    return nil
  end
  for name, gres in pairs(per_task) do
    local want = gres.count * tasks
    if per_node[name] == nil or per_node[name].count < want then
      per_node[name] = {count = want, type = gres.type or (per_node[name] and per_node[name].type)}
    end
  end
  return {cpus = cpus, memory_mib = memory, gres = per_node, nodes = given(job_desc.min_nodes) or 1,
          all_cpus = given(job_desc.min_cpus) or 0, all_gres = in_all}
end

local function has(pool, name, gres)
  local own = pool.gres[name]
  return own ~= nil and (gres.type == nil or gres.type == own.type), own
end

-- What one node of the pool lacks for the job, as "<what> per node" phrases.
local function lacks(pool, need)
  local missing = {}
  for name, gres in pairs(need.gres) do
    local ok, own = has(pool, name, gres)
    if gres.count > 0 and not (ok and own.count >= gres.count) then
      table.insert(missing, gres_text(name, gres) .. " per node")
    end
  end
  if need.cpus > pool.cpus then
    table.insert(missing, counted(need.cpus, "CPU") .. " per node")
  end
  if need.memory_mib and need.memory_mib > pool.memory_mib then
    table.insert(missing, gib(need.memory_mib) .. " per node")
  end
  return missing
end

-- Why the partition can never run the job, or nil when it can.
local function refusal(partition, pools, need)
  local fitting = {nodes = 0, cpus = 0}
  local missing, seen = {}, {}
  for _, pool in ipairs(pools) do
    local lacking = lacks(pool, need)
    if #lacking == 0 then
      fitting.nodes = fitting.nodes + pool.nodes
      fitting.cpus = fitting.cpus + pool.nodes * pool.cpus
    end
    for _, text in ipairs(lacking) do
      if not seen[text] then
        seen[text] = true
        table.insert(missing, text)
      end
    end
  end
  if fitting.nodes > 0 then
    missing = {}
    if need.nodes > fitting.nodes then
      table.insert(missing, counted(need.nodes, "node"))
    end
    if need.all_cpus > fitting.cpus then
      table.insert(missing, counted(need.all_cpus, "CPU") .. " in all")
    end
    for name, gres in pairs(need.all_gres) do
      local total = 0
      for _, pool in ipairs(pools) do
        local ok, own = has(pool, name, gres)
        if ok and #lacks(pool, need) == 0 then
          total = total + own.count * pool.nodes
        end
      end
      if gres.count > total then
        table.insert(missing, gres_text(name, gres) .. " in all")
      end
    end
  end
  if #missing == 0 then
    return nil
  end
  return string.format("partition %s: %s; the job asks %s", partition, shapes_text(pools),
                       table.concat(missing, ", "))
end

function slurm_job_submit(job_desc, part_list, submit_uid)
  local need = needs(job_desc)
  if need == nil then
    return slurm.SUCCESS
  end
  local reasons = {}
  for partition in string.gmatch(job_desc.partition or DEFAULT_PARTITION, "[^,]+") do
    local pools = PARTITIONS[partition]
    if pools == nil then
      return slurm.SUCCESS  -- not one of the pools': Slurm answers for it
    end
    local reason = refusal(partition, pools, need)
    if reason == nil then
      return slurm.SUCCESS
    end
    table.insert(reasons, reason)
  end
  for _, reason in ipairs(reasons) do
    slurm.log_user("%s", reason)
  end
  return slurm.ESLURM_REQUESTED_NODE_CONFIG_UNAVAILABLE  -- Slurm's own words for such a job
end

-- A queued job changed by `scontrol update` is left to Slurm.
function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
  return slurm.SUCCESS
end

return slurm.SUCCESS
