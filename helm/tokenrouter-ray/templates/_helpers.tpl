{{/* Chart name, truncated to a DNS label. */}}
{{- define "tokenrouter-ray.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified name: the RayService's name. Kept to 40 characters because KubeRay derives
longer names from it (<name>-raycluster-xxxxx, <name>-serve-svc, <name>-head-svc).
*/}}
{{- define "tokenrouter-ray.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The Service KubeRay creates in front of the healthy Serve proxies. */}}
{{- define "tokenrouter-ray.serveServiceName" -}}
{{- printf "%s-serve-svc" (include "tokenrouter-ray.fullname" .) }}
{{- end }}

{{/* The direct port's Service, in front of the `ingress` worker group's pods. */}}
{{- define "tokenrouter-ray.directServiceName" -}}
{{- printf "%s-direct" (include "tokenrouter-ray.fullname" .) }}
{{- end }}

{{/*
The Ray resource the `ingress` group's pods advertise (directPort.replicasPerPod units each)
and each ingress replica asks one unit of: it keeps the ingress replicas on those pods only.
*/}}
{{- define "tokenrouter-ray.ingressResource" -}}
tokenrouter_ingress
{{- end }}

{{/* The labels of the `ingress` group's pods, which the direct Service selects by. */}}
{{- define "tokenrouter-ray.directSelectorLabels" -}}
{{ include "tokenrouter-ray.selectorLabels" . }}
app.kubernetes.io/component: ingress
{{- end }}

{{/*
Readiness of an `ingress` pod: its ingress replicas answer /health on the direct port (200
once every model has a replica), where the Service sends traffic, and its Serve proxy is
healthy, the check KubeRay puts on RayService workers itself and leaves out when a probe is
given (the pod is behind <name>-serve-svc too). In the container, so $POD_IP is the address
the replicas bind (ingress.direct_host=null: Ray's node address, the pod's).
*/}}
{{- define "tokenrouter-ray.directReadinessProbe" -}}
exec:
  command:
    - bash
    - -c
    - >-
      wget --tries 1 -T 2 -q -O /dev/null http://${POD_IP}:{{ .Values.directPort.port }}/health
      && wget --tries 1 -T 2 -q -O- http://localhost:{{ .Values.serve.port }}/-/healthz | grep -q success
initialDelaySeconds: 10
periodSeconds: 5
timeoutSeconds: 5
failureThreshold: 2
successThreshold: 1
{{- end }}

{{- define "tokenrouter-ray.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tokenrouter-ray.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tokenrouter-ray.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "tokenrouter-ray.labels" -}}
helm.sh/chart: {{ include "tokenrouter-ray.chart" . }}
{{ include "tokenrouter-ray.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "tokenrouter-ray.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The app's Hydra overrides, one per line, in the order conf/r2r_cross_node.yaml has them. */}}
{{- define "tokenrouter-ray.overrides" -}}
- models={{ .Values.serve.modelsConfig }}
- policy={{ .Values.policy }}
- transport={{ .Values.transport.name }}
- placement={{ .Values.placement }}
- tuner={{ .Values.tuner }}
{{- if .Values.speedBypass }}
- tuner.speed_bypass={}
{{- end }}
{{- if eq .Values.transport.name "zmq_tcp" }}
- transport.zmq.port_range=[{{ .Values.transport.zmqPorts.first }},{{ .Values.transport.zmqPorts.last }}]
{{- if .Values.transport.curve }}
- transport.zmq.curve=true
{{- end }}
{{- end }}
{{- $scaled := include "tokenrouter-ray.scaledModels" . | fromYaml }}
{{- range $model := .Values.models }}
{{- with get $scaled $model.name }}
{{- include "tokenrouter-ray.autoscalingOverrides" (dict "key" (printf "models.%s" $model.name) "bounds" .) }}
{{- end }}
{{- end }}
{{- with (.Values.autoscaling | default dict).ingress }}
{{- include "tokenrouter-ray.autoscalingOverrides" (dict "key" "ingress" "bounds" .) }}
{{- end }}
{{- with .Values.directPort }}
{{- if .enabled }}
- ingress.num_replicas={{ mul .worker.replicas .replicasPerPod }}
- ingress.resources={{ printf "{%s:1}" (include "tokenrouter-ray.ingressResource" $) }}
- ingress.direct_port={{ .port }}
- ingress.direct_host=null
{{- if .sendBufferKiB }}
- ingress.direct_send_buffer_kib={{ .sendBufferKiB }}
{{- end }}
{{- end }}
{{- end }}
{{- range .Values.serve.extraOverrides }}
- {{ . | toJson }}
{{- end }}
{{- end }}

{{/*
The models that autoscale (autoscaling.models), as YAML: name -> bounds, each with minReplicas
filled in (the app's default, 1) and initialReplicas (null: minReplicas); {} when none.
*/}}
{{- define "tokenrouter-ray.scaledModels" -}}
{{- $scaled := dict }}
{{- range $name, $bounds := (.Values.autoscaling | default dict).models | default dict }}
{{- if $bounds }}
{{- $min := $bounds.minReplicas | default 1 | int }}
{{- $initial := $bounds.initialReplicas | default $min | int }}
{{- $_ := set $scaled $name (merge (dict "minReplicas" $min "initialReplicas" $initial) $bounds) }}
{{- end }}
{{- end }}
{{- toYaml $scaled }}
{{- end }}

{{/*
The Hydra overrides of one deployment's autoscaling, from a dict: `key` (models.<name> or
ingress) and `bounds` (the values' keys, camelCase). minReplicas and maxReplicas always; the
others only when given, so the app's defaults (config.py, AutoscalingSpec) apply otherwise.
*/}}
{{- define "tokenrouter-ray.autoscalingOverrides" -}}
{{- $bounds := .bounds }}
{{- $key := .key }}
- {{ $key }}.autoscaling.min_replicas={{ $bounds.minReplicas | default 1 | int }}
- {{ $key }}.autoscaling.max_replicas={{ int $bounds.maxReplicas }}
{{- range list (list "initialReplicas" "initial_replicas") (list "targetUtilisation" "target_utilisation") (list "upscaleDelayS" "upscale_delay_s") (list "downscaleDelayS" "downscale_delay_s") (list "metricsIntervalS" "metrics_interval_s") (list "lookBackPeriodS" "look_back_period_s") }}
{{- if and (hasKey $bounds (index . 0)) (not (kindIs "invalid" (get $bounds (index . 0)))) }}
- {{ $key }}.autoscaling.{{ index . 1 }}={{ get $bounds (index . 0) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Refuses autoscaling bounds the app would refuse at deploy time, naming the values' key, from a
dict: `what` (the values' path) and `bounds`.
*/}}
{{- define "tokenrouter-ray.checkBounds" -}}
{{- $min := .bounds.minReplicas | default 1 | int }}
{{- $max := int .bounds.maxReplicas }}
{{- if lt $max $min }}
{{- fail (printf "%s: maxReplicas %d is below minReplicas %d" .what $max $min) }}
{{- end }}
{{- $initial := .bounds.initialReplicas | default $min | int }}
{{- if or (lt $initial $min) (gt $initial $max) }}
{{- fail (printf "%s: initialReplicas %d is outside [minReplicas %d, maxReplicas %d]" .what $initial $min $max) }}
{{- end }}
{{- end }}

{{/*
The RayService's autoscalerOptions (autoscaling.ray): the autoscaler sidecar KubeRay adds to the
head pod runs the head's image, with the chart's pull policy, container security context and
writable emptyDirs (its root filesystem is read-only too), and no secret in its environment.
*/}}
{{- define "tokenrouter-ray.autoscalerOptions" -}}
{{- $ray := (.Values.autoscaling | default dict).ray | default dict }}
{{- $options := dict "imagePullPolicy" .Values.image.pullPolicy "securityContext" .Values.containerSecurityContext }}
{{- with include "tokenrouter-ray.writableMounts" . | trim }}
{{- $_ := set $options "volumeMounts" (. | fromYamlArray) }}
{{- end }}
{{- range list "upscalingMode" "idleTimeoutSeconds" "version" "resources" }}
{{- if and (hasKey $ray .) (not (kindIs "invalid" (get $ray .))) }}
{{- $_ := set $options . (get $ray .) }}
{{- end }}
{{- end }}
{{- toYaml $options }}
{{- end }}

{{/* The Ray Serve config (serveConfigV2): the same document as conf/r2r_cross_node.yaml. */}}
{{- define "tokenrouter-ray.serveConfig" -}}
proxy_location: {{ .Values.serve.proxyLocation }}
http_options:
  host: 0.0.0.0
  port: {{ .Values.serve.port }}
  request_timeout_s: {{ .Values.serve.requestTimeoutS }}
applications:
  - name: {{ .Values.serve.appName }}
    route_prefix: {{ .Values.serve.routePrefix }}
    import_path: {{ .Values.serve.importPath }}
    args:
      overrides:
{{ include "tokenrouter-ray.overrides" . | indent 8 }}
{{- end }}

{{/*
rayStartParams.resources in the form KubeRay passes to `ray start --resources=...` through a
shell: a JSON object in double quotes with its inner quotes backslash-escaped,
e.g. "{\"tokenrouter_small\": 1}". Takes a dict with the resource's `name` and `units`.
*/}}
{{- define "tokenrouter-ray.rayResources" -}}
{{- printf "\"{\\\"%s\\\": %d}\"" .name (int .units) }}
{{- end }}

{{/* Environment and volume mounts shared by every Ray container. */}}
{{- define "tokenrouter-ray.containerEnv" -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: TOKENROUTER_PEER_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "tokenrouter-ray.peerSecretName" . | quote }}
      key: {{ .Values.peerSecret.key | quote }}
- name: HF_HOME
  value: {{ .Values.modelCache.mountPath | quote }}
- name: TOKENROUTER_ROUTER_DIR
  value: {{ .Values.routers.mountPath | quote }}
{{- with .Values.apiKeys }}
{{- if .existingSecret }}
- name: TOKENROUTER_API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ .existingSecret | quote }}
      key: {{ .key | quote }}
{{- end }}
{{- end }}
{{- if eq .Values.serveFront "haproxy" }}
- name: RAY_SERVE_ENABLE_HA_PROXY
  value: "1"
{{- end }}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "tokenrouter-ray.modelCacheVolume" -}}
- name: model-cache
{{- if .Values.modelCache.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.modelCache.existingClaim }}
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.modelCache.sizeLimit }}
{{- end }}
{{- end }}

{{/* Router checkpoints: the PVC (read-only), else an emptyDir the init container fills. */}}
{{- define "tokenrouter-ray.routersVolume" -}}
- name: routers
{{- if .Values.routers.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.routers.existingClaim }}
    readOnly: true
{{- else }}
  emptyDir: {}
{{- end }}
{{- end }}

{{- define "tokenrouter-ray.routersMount" -}}
- name: routers
  mountPath: {{ .Values.routers.mountPath }}
{{- if .Values.routers.existingClaim }}
  readOnly: true
{{- end }}
{{- end }}

{{/*
The init container that fetches routers into the emptyDir before Ray starts (empty when
routers.fetch has neither files nor a command): curl for each of `files`, else `command`.
*/}}
{{- define "tokenrouter-ray.routersFetch" -}}
{{- $fetch := .Values.routers.fetch | default dict }}
{{- if or $fetch.files $fetch.command }}
{{- if .Values.routers.existingClaim }}
{{- fail "routers: set either existingClaim or fetch (files or command), not both" }}
{{- end }}
- name: fetch-routers
  image: {{ $fetch.image | default "curlimages/curl:8.11.1" }}
  command:
  {{- if $fetch.command }}
    {{- toYaml $fetch.command | nindent 4 }}
  {{- else }}
    - sh
    - -ec
    - |
      {{- range $fetch.files }}
      curl -fsSL --retry 5 -o {{ printf "%s/%s" $.Values.routers.mountPath .name | squote }} {{ .url | squote }}
      {{- end }}
  {{- end }}
  {{- with $fetch.env }}
  env:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $fetch.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: routers
      mountPath: {{ .Values.routers.mountPath }}
{{- end }}
{{- end }}

{{/* The Secret holding the peer secret: the user's, else the one this chart keeps. */}}
{{- define "tokenrouter-ray.peerSecretName" -}}
{{- .Values.peerSecret.existingSecret | default (printf "%s-peer-secret" (include "tokenrouter-ray.fullname" .)) }}
{{- end }}

{{/* Ray's ports as `ray start` parameters (strings, as KubeRay wants them). */}}
{{- define "tokenrouter-ray.rayPortParams" -}}
{{- with .Values.rayPorts }}
node-manager-port: {{ .nodeManager | quote }}
object-manager-port: {{ .objectManager | quote }}
runtime-env-agent-port: {{ .runtimeEnvAgent | quote }}
dashboard-agent-grpc-port: {{ .dashboardAgentGrpc | quote }}
dashboard-agent-listen-port: {{ .dashboardAgentListen | quote }}
min-worker-port: {{ .minWorker | quote }}
max-worker-port: {{ .maxWorker | quote }}
{{- end }}
{{- end }}

{{/* emptyDirs over the read-only root filesystem where Ray, Python and torch write. */}}
{{- define "tokenrouter-ray.writableVolumes" -}}
{{- range $i, $path := .Values.writableDirs }}
- name: writable-{{ $i }}
  emptyDir: {}
{{- end }}
{{- end }}

{{- define "tokenrouter-ray.writableMounts" -}}
{{- range $i, $path := .Values.writableDirs }}
- name: writable-{{ $i }}
  mountPath: {{ $path }}
{{- end }}
{{- end }}

{{/*
One entry of workerGroupSpecs, from a dict: `root` (the chart's context), `name`, `worker`
(replicas, minReplicas, maxReplicas, rayStartParams, resources, shmSize, nodeSelector,
tolerations, affinity), `gpus` (nvidia.com/gpu per pod; 0: none), `nodeResource` (name and
units of the custom Ray resource each pod advertises), `labels` and `annotations` of the pods
(the release's selector labels come first), `ports` (extra container ports) and
`readinessProbe` (absent: KubeRay injects its own).
*/}}
{{- define "tokenrouter-ray.workerGroup" -}}
{{- $root := .root }}
{{- $worker := .worker }}
{{- $fetchRouters := include "tokenrouter-ray.routersFetch" $root | trim }}
- groupName: {{ .name }}
  replicas: {{ $worker.replicas }}
  minReplicas: {{ $worker.minReplicas }}
  maxReplicas: {{ $worker.maxReplicas }}
  rayStartParams:
    {{- $params := merge (dict "resources" (include "tokenrouter-ray.rayResources" .nodeResource) "metrics-export-port" (toString $root.Values.metrics.port)) (include "tokenrouter-ray.rayPortParams" $root | fromYaml) }}
    {{- toYaml (merge (deepCopy ($worker.rayStartParams | default dict)) $params) | nindent 4 }}
  template:
    metadata:
      labels:
        {{- include "tokenrouter-ray.selectorLabels" $root | nindent 8 }}
        {{- toYaml .labels | nindent 8 }}
      {{- with .annotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $fetchRouters }}
      initContainers:
        {{- . | nindent 8 }}
      {{- end }}
      containers:
        - name: ray-worker
          image: {{ include "tokenrouter-ray.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          securityContext:
            {{- toYaml $root.Values.containerSecurityContext | nindent 12 }}
          ports:
            - name: serve
              containerPort: {{ $root.Values.serve.port }}
            - name: metrics
              containerPort: {{ $root.Values.metrics.port }}
            {{- with .ports }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          env:
            {{- include "tokenrouter-ray.containerEnv" $root | nindent 12 }}
          {{- with .readinessProbe }}
          readinessProbe:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          resources:
            limits:
              {{- $limits := deepCopy ($worker.resources.limits | default dict) }}
              {{- if .gpus }}
              {{- $limits = merge (dict "nvidia.com/gpu" .gpus) $limits }}
              {{- end }}
              {{- toYaml $limits | nindent 14 }}
            {{- with $worker.resources.requests }}
            requests:
              {{- toYaml . | nindent 14 }}
            {{- end }}
          volumeMounts:
            - name: dshm
              mountPath: /dev/shm
            - name: model-cache
              mountPath: {{ $root.Values.modelCache.mountPath }}
            {{- include "tokenrouter-ray.routersMount" $root | nindent 12 }}
            {{- include "tokenrouter-ray.writableMounts" $root | nindent 12 }}
      volumes:
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $worker.shmSize }}
        {{- include "tokenrouter-ray.writableVolumes" $root | nindent 8 }}
        {{- include "tokenrouter-ray.modelCacheVolume" $root | nindent 8 }}
        {{- include "tokenrouter-ray.routersVolume" $root | nindent 8 }}
      {{- with $worker.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $worker.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $worker.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end }}
